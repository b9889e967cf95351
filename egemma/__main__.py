"""`python -m egemma`: the launcher (egemma.ops.launcher)."""
from egemma.ops.launcher import main

main()
