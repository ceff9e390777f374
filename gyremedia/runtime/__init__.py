"""The run's infrastructure, beneath the loop and its stages: processes and their collectives (distributed.py),
FSDP2 sharding (sharding.py), atomic and verified checkpoints (checkpoint.py), background threads (threads.py),
every random stream (streams.py), stop signals (signals.py) and run folders (runs.py)."""
