"""lnstab: stability of transformers under layer normalisation, as a Lightning experiment suite."""

from lnstab.distributed import end_gloo_group_at_exit

end_gloo_group_at_exit()  # gloo groups end before the interpreter's finalisation (see lnstab.distributed)
