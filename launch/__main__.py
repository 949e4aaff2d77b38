"""`python -m launch ARGS` = `nvl72 launch ARGS`: the per-rank entry that srun/mpirun start."""
import sys

from nvl72.cli import main

sys.exit(main(["launch", *sys.argv[1:]]))
