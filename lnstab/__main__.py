"""``python -m lnstab``: the ``lnstab`` command (for an environment whose scripts directory is not on ``PATH``)."""

from lnstab.cli import main

main()
