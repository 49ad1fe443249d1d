import sys

from .cli import main

if __name__ == "__main__":  # spawned tensor-parallel workers import this module as __mp_main__
    sys.exit(main())
