"""A verifiers taskset + env plugin (taskset id ``vf_offline_env``) whose episodes are built offline.

``OfflineEnv.run_episode`` keeps verifiers' contract for the env server (``Env.run_slot``
wraps it in episode retries; ``on_trace`` sees every trace at mint; ``on_discard`` sees a
retried agent attempt's trace) but builds the traces with ``vf_traces`` instead of
running agents against a model. ``OfflineData.script`` picks the episode:

- ``multi_turn``: one trace, ``vf_traces.multi_turn_steps`` (two branches; the loop runs between turns),
  rewarded ``reward``;
- ``agent_retry``: a first attempt's trace completes and is kept, then the agent retries
  (``on_discard`` of the first trace); the second attempt's trace is the episode's;
- ``episode_retry``: the first episode attempt fails with a retryable error after its
  trace completed and was kept; the second attempt succeeds;
- ``judged``: a trainable trace plus an untrainable judge trace;
- ``hang`` / ``fail``: a trace completes and is kept, then the episode waits forever /
  raises ``RuntimeError`` (the run is abandoned).

Scripts that wait for a keep (``await kept(trace)``) only run on a ``RefpipeEnvServer``.
"""

from __future__ import annotations

import asyncio
from typing import Literal

from verifiers.v1.configs.agent import AgentConfig
from verifiers.v1.configs.env import EnvConfig
from verifiers.v1.env import Env
from verifiers.v1.episode import EnvInfo, Episode
from verifiers.v1.task import Task, TaskData
from verifiers.v1.taskset import Taskset
from verifiers.v1.trace import Error, TraceTask

from refpipe.integrations.verifiers_branches import INFO_KEY
from tests.integrations.vf_traces import Engine, complete, multi_turn, multi_turn_steps, new_trace


class OfflineData(TaskData):
    seed: int = 0
    script: Literal["multi_turn", "agent_retry", "episode_retry", "judged", "hang", "fail"] = "multi_turn"
    reward: float = 1.0


class OfflineTask(Task[OfflineData]):
    pass


class OfflineTaskset(Taskset[OfflineTask]):
    def load(self):
        yield OfflineTask(OfflineData(prompt="q"))


class OfflineEnvConfig(EnvConfig):
    agent: AgentConfig = AgentConfig()


async def kept(trace, timeout_s: float = 30.0) -> None:
    """Wait until a RefpipeEnvServer wrote the trace's refs (its keep ran)."""
    async with asyncio.timeout(timeout_s):
        while INFO_KEY not in trace.info:
            await asyncio.sleep(0.01)


class OfflineEnv(Env[OfflineEnvConfig]):
    async def run(self, task, agents) -> None:
        raise NotImplementedError("OfflineEnv builds its episodes in run_episode")

    async def run_episode(self, task, ctx, *, on_trace=None, on_discard=None) -> Episode:
        data: OfflineData = task.data
        attempts = self.__dict__.setdefault("attempts", {})  # per seed, across this env's requests
        attempt = attempts[data.seed] = attempts.get(data.seed, 0) + 1
        episode = Episode(env=EnvInfo(id=self.config.env_id),
                          task=TraceTask(type=type(task).__name__, data=data, key=task.key, hash=task.hash))
        trace = await self._trace(f"s{data.seed}-a{attempt}", data, on_trace)
        if data.script == "agent_retry":
            await kept(trace)
            on_discard(trace)
            trace = await self._trace(f"s{data.seed}-a{attempt}-retry", data, on_trace)
        elif data.script == "episode_retry" and attempt == 1:
            await kept(trace)
            episode.traces.append(trace)
            episode.errors.append(Error(type="ProviderError", message="flaky engine"))
            return episode
        elif data.script == "judged":
            judge = new_trace(f"s{data.seed}-judge", trainable=False)
            on_trace(judge)
            multi_turn(judge, Engine(data.seed + 1000))
            complete(judge)
            episode.traces.append(judge)
        elif data.script in ("hang", "fail"):
            await kept(trace)
            if data.script == "fail":
                raise RuntimeError("env crashed after a trace completed")
            await asyncio.Event().wait()
        episode.traces.append(trace)
        episode.ok = True
        return episode

    @staticmethod
    async def _trace(trace_id: str, data: OfflineData, on_trace):
        trace = new_trace(trace_id)
        on_trace(trace)
        for _ in multi_turn_steps(trace, Engine(data.seed)):  # a turn at a time, as an agent's requests land
            trace.notify()
            await asyncio.sleep(0)
        complete(trace, data.reward)
        trace.notify()
        await asyncio.sleep(0)
        return trace


__all__ = ["OfflineEnv", "OfflineTaskset"]
