"""`python -m mtpserve` runs the mtpserve CLI."""

import sys

from mtpserve.cluster.cli.mtpserve import main

sys.exit(main())
