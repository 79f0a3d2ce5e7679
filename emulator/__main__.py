import sys

from emulator.cli import main

raise SystemExit(main(sys.argv[1:]))
