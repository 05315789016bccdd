"""`python -m cluster` runs the mtpserve CLI."""

import sys

from cluster.cli.mtpserve import main

sys.exit(main())
