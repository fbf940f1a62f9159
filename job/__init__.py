"""The main job's model side: the MoE policy, sampling with side channels, the task, the loss."""
