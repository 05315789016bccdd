"""`python -m cluster` runs the mtpserve CLI."""

import sys

from cluster.cli import main

sys.exit(main())
