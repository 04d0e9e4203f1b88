"""lnstab: stability of transformers under layer normalisation, as a Lightning experiment suite."""

import atexit

from lnstab.distributed import end_gloo_group

atexit.register(end_gloo_group)  # gloo groups end before the interpreter's finalisation (see lnstab.distributed)
