"""``python -m fedjax_fair.cli`` = ``fedjax-fair``."""
from fedjax_fair.cli import console

console()
