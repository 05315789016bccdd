"""`python -m mtpserve.cluster.job`, the Ray job entry point the manifests name (`cluster/cli/job.py`)."""

import sys

from mtpserve.cluster.cli.job import main

if __name__ == "__main__":
    sys.exit(main())
