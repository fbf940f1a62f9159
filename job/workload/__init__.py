"""The toy workload the main job trains: a small MoE policy (``model``), the reverse-a-word task (``task``),
sampling with side channels (``rollout``) and the policy-gradient loss (``loss``). The roles in ``job/`` run it;
refpipe's layers (``storage``, ``pipeline``, ``trainer``) never import it."""
