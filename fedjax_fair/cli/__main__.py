"""``python -m fedjax_fair.cli`` = ``fedjax-fair``."""
import sys

from fedjax_fair.cli import main

sys.exit(main())
