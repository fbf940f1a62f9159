"""Trainer ranks: step loading, per-rank fetch, assembly, failure all-reduce, release, checkpoints, resume.

Modules: ``config`` (TrainerConfig), ``dist`` (topology ``dp_rank = rank // model_parallel_size``,
``mp_rank = rank % model_parallel_size``; process group with timeouts; the collectives),
``fetch`` (wait for a step file; fetch + assemble one DP rank's micro batches), ``assemble``
(numpy-only padded layout, also used by ``refpipe show``), ``tensors`` (numpy -> torch),
``step`` (``TrainerRank.run_step``: the per-step flow and which ranks call what), ``loop`` (the pull
loop ``TrainerRank.steps``: ``TrainingStep``, ``StepDataset``), ``metrics`` (``StepMetrics``), ``background``
(prefetch, background release), ``release`` (release policies, retention), ``checkpoint`` (DCP
checkpoints with refpipe's commit marker), ``resume`` (a restarted trainer's plan), ``pause``
(the crash tests' pause points).
"""

# This folder installs as refpipe.trainer only: a copy under a bare name would hold types that are not refpipe's.
if __name__ != "refpipe.trainer":
    raise ImportError(f"{__name__}: refpipe's trainer/ folder imported under a bare name (the repository root "
                      "is on sys.path); import refpipe.trainer instead", name=__name__)
