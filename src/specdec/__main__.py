"""`python -m specdec`: the `specdec` command."""

from specdec.cli.main import main

main()
