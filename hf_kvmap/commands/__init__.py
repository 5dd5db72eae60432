"""Sub-commands of the `hf-kvmap` command line; each module defines `add_parser(subparsers)` and `run(args)`."""
