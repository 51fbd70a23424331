from runner.cli import main
from runner.mpi import exit_rank

try:
    code = main()
except SystemExit as stop:  # argparse's errors and --help
    code = stop.code
exit_rank(code)
