"""`python -m flagscale.cli ...`: the `flagscale` command without its console script."""

from flagscale.cli.main import main

main()
