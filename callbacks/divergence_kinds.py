"""DivergenceMonitor's event kinds and the ones its policy acts on by default, without Lightning: ``lnstab check``'s
parent, which never trains, reads a run's first fatal event by them."""

POLICIES = ("stop", "skip", "continue")
KINDS = (
    "nonfinite_loss",
    "nonfinite_grad",
    "nonfinite_param",
    "nonfinite_activation",
    "grad_explosion",
    "loss_explosion",
    "loss_spike",
    "activation_overflow",
    "attention_collapse",
    "logit_drift",
    "remote",
)
FATAL = ("nonfinite_loss", "nonfinite_grad", "nonfinite_param", "nonfinite_activation", "grad_explosion",
         "loss_explosion", "remote")
