"""Client side: a served verifiers 0.4 episode (with refs) as an orchestrator ``Episode``.

``EnvClient.run`` (verifiers) assembles the deltas of a ``RefpipeEnvServer`` into a
``WireEpisode``; ``orchestrator_episode`` turns it into a ``pipeline.samples.Episode``:
one ``BranchResult`` per trainable branch (``verifiers_branches.trainable_branches``),
prompt = tokens before the first sampled token, completion = the rest, with the
branch's ref from ``Trace.info["refpipe"]``. Once the run's reply arrived, its refs
belong to the client: ``run_episode`` deletes them (through the ledger, exactly once)
when the episode cannot be handed to the orchestrator.
"""

from __future__ import annotations

import numpy as np
from verifiers.v1.configs.client import BaseClientConfig
from verifiers.v1.episode import EvalRunInfo, EvalWorkInfo, WireEpisode
from verifiers.v1.serve.client import EnvClient
from verifiers.v1.trace import Trace
from verifiers.v1.types import SamplingConfig

from refpipe.integrations.verifiers_branches import num_prompt_tokens, read_refs, trainable_branches
from refpipe.pipeline.samples import BranchResult, Episode
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.errors import EpisodeError
from refpipe.storage.ledger import Ledger

DEFAULT_TEMPERATURE = 1.0
"""Sampling temperature when the request leaves it unset (the engines' default)."""


def episode_refs(episode: WireEpisode) -> list[PayloadRef]:
    """Every ref the episode carries, in trace and leaf order.

    Raises:
        EpisodeError: a trace's refs record is malformed.
    """
    return [ref for i, t in enumerate(episode.traces) for ref in read_refs(t.info, _what(episode, i)).values()]


def orchestrator_episode(episode: WireEpisode, *, temperature: float, policy_version: int,
                         group_id: str | None = None) -> Episode:
    """The orchestrator's view of a served episode (no I/O, nothing deleted).

    Args:
        episode: as ``EnvClient.run`` returns it from a ``RefpipeEnvServer``.
        temperature: sampling temperature of the run (> 0).
        policy_version: trainer step whose weights generated the episode.
        group_id: the advantage group; default ``episode.group.id``, else the episode id.

    Returns:
        ``Episode`` with one ``BranchResult`` per trainable branch (``prompt_ids`` int32 [P],
        ``completion_ids`` int32 [C], ``inference_logprobs`` float32 [C], 0 on unsampled
        completion tokens), rewards per branch (its trace's ``reward``), ``is_eval`` from
        ``episode.run``; ``env_name`` is ``episode.env.name`` or its id.

    Raises:
        EpisodeError: no trainable branch; side channels inline (not served by
            ``RefpipeEnvServer``); a refs record that is malformed, names a leaf that is
            not a trainable branch, or disagrees with the branch's token counts.
    """
    branches: list[BranchResult] = []
    rewards: list[float] = []
    for i, trace in enumerate(episode.traces):
        what = _what(episode, i)
        _check_no_inline_arrays(trace, what)
        refs = read_refs(trace.info, what)
        for leaf, branch in trainable_branches(trace):
            branches.append(_branch_result(branch, refs.pop(leaf, None), temperature, policy_version,
                                           f"{what} leaf {leaf}"))
            rewards.append(trace.reward)
        if refs:
            raise EpisodeError(f"{what}: refs name leaves {sorted(refs)} that are not trainable branches")
    if not branches:
        raise EpisodeError(f"episode {episode.id!r}: no trainable branch with a sampled token")
    group = group_id or (episode.group.id if episode.group is not None else episode.id)
    return Episode(episode_id=episode.id, group_id=group, env_name=episode.env.name or episode.env.id,
                   reward=rewards, branches=branches, is_eval=_is_eval(episode))


async def run_episode(client: EnvClient, ledger: Ledger, *, client_config: BaseClientConfig, model: str,
                      sampling: SamplingConfig, task_data: dict, policy_version: int,
                      group_id: str | None = None) -> Episode:
    """Run one rollout on a ``RefpipeEnvServer`` and return it as an orchestrator ``Episode``.

    Raises:
        RuntimeError: the server reported the run failed (it deleted what it kept).
        EpisodeError: the episode cannot become an orchestrator episode; its refs were
            deleted through ``ledger`` first (reason names the episode).
    """
    wire = await client.run(client_config, model, sampling, task_data)
    temperature = sampling.temperature if sampling.temperature is not None else DEFAULT_TEMPERATURE
    try:
        return orchestrator_episode(wire, temperature=temperature, policy_version=policy_version, group_id=group_id)
    except EpisodeError as e:
        refs = episode_refs(wire)
        if refs:
            ledger.delete(refs, reason=f"verifiers client: episode {wire.id} rejected: {e}")
        raise


def _branch_result(branch, ref: PayloadRef | None, temperature: float, policy_version: int, what: str) -> BranchResult:
    prompt = num_prompt_tokens(branch)
    tokens = np.asarray(branch.token_ids, np.int32)
    logprobs = np.asarray(branch.logprobs, np.float32)
    if ref is not None and (ref.num_prompt_tokens, ref.num_completion_tokens) != (prompt, len(tokens) - prompt):
        raise EpisodeError(f"{what}: ref {ref.uri} holds {ref.num_prompt_tokens} prompt + {ref.num_completion_tokens} "
                           f"completion tokens: expected {prompt} + {len(tokens) - prompt} (the branch's tokens)")
    return BranchResult(prompt_ids=tokens[:prompt], completion_ids=tokens[prompt:],
                        inference_logprobs=logprobs[prompt:], temperature=temperature,
                        policy_version=policy_version, ref=ref,
                        completion_mask=np.asarray(branch.sampled_mask, np.bool_)[prompt:])


def _check_no_inline_arrays(trace: Trace, what: str) -> None:
    inline = [i for i, n in enumerate(trace.nodes) if n.routed_experts is not None or n.sampling_mask is not None]
    if inline:
        raise EpisodeError(f"{what}: nodes {inline[:5]} carry side channels inline: expected refs "
                           f"(serve the env with integrations.verifiers_server.RefpipeEnvServer)")


def _is_eval(episode: WireEpisode) -> bool:
    run = episode.run
    return isinstance(run, EvalRunInfo) or (run is not None and isinstance(run.work, EvalWorkInfo))


def _what(episode: WireEpisode, index: int) -> str:
    return f"episode {episode.id!r} trace {episode.traces[index].id!r}"
