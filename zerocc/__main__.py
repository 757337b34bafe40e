"""`python -m zerocc`: the zerocc command line."""

from zerocc.cli.main import console

console()
