"""The main job's roles (launcher, fleet, env workers, trainer ranks, ...) and, in ``job.workload``, the toy
workload they run: the MoE policy, sampling with side channels, the task, the loss."""

# This folder installs as refpipe.job only: a copy under a bare name would hold types that are not refpipe's.
if __name__ != "refpipe.job":
    raise ImportError(f"{__name__}: refpipe's job/ folder imported under a bare name (the repository root "
                      "is on sys.path); import refpipe.job instead", name=__name__)
