"""The `mtpserve` command line and `python -m mtpserve.cluster.job`: sub-commands, shared flags, `make demo`."""
