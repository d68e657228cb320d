"""Built-in losses (``register_losses``); the comments cite each one's section of docs/methods.md
(METHODS §N). Implementations are imported inside the hook (see :mod:`clipkit.plugins.encoders` for
the pattern)."""

from clipkit.contract.hookspecs import hookimpl


@hookimpl
def register_losses(register):
    from clipkit.plugins.losses import baseline_losses, cloob, infonce, nuclr, yaware

    register("infonce", infonce.InfoNCE)  # METHODS §1
    register("infoloob", cloob.InfoLOOB)  # §4
    register("cloob", cloob.CLOOBLoss)  # §4
    register("siglip", baseline_losses.SigLIPLoss)  # §7
    register("cyclip", baseline_losses.CyCLIPLoss)  # §7
    register("dcl", baseline_losses.DecoupledContrastiveLoss)  # §7, §11 (decoupled)
    register("debiased", baseline_losses.DebiasedContrastiveLoss)  # §11 (Chuang et al.)
    register("yaware_infonce", yaware.YAwareInfoNCE)  # §5
    register("cond_align_unif", yaware.ConditionalAlignUniform)  # §5
    register("simclr", yaware.SimCLRLoss)  # §5, §11
    register("supcon", yaware.SupConLoss)  # §5, §11
    register("align_uniform", yaware.AlignUniform)  # §5
    register("sogclr", nuclr.SogCLRLoss)  # §6
    register("nuclr", nuclr.NUCLRLoss)  # §6


@hookimpl
def register_distill_losses(register):
    from clipkit.plugins.losses import distill

    register("kl", distill.KLDistillation)  # open_clip's DistillClipLoss term (docs/distillation.md)
    register("feature_cosine", distill.FeatureCosine)
    register("feature_mse", distill.FeatureMSE)
