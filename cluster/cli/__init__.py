"""The `mtpserve` command line and `python -m cluster.job`: the sub-commands, their shared flags, `make demo`."""

from cluster.cli.mtpserve import main as main  # `cluster.cli:main`, the console script of earlier installs
