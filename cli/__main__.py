"""`python -m edgespec.cli` runs the same app as the `edgespec` console script."""
from edgespec.cli import main

main()
