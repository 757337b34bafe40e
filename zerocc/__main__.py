"""`python -m zerocc`: the zerocc command line."""

from zerocc.cli import main

raise SystemExit(main())
