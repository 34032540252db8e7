"""Running vLLM: its command line, its process tree, and a client for its endpoints.

vllm_launch.py (vLLM's argv and environment), vllm_process.py (starting,
watching and stopping the tree, reaped by the agent as PID 1) and
vllm_control.py (the HTTP client for vLLM's sleep, wake-up and collective RPC
endpoints). Separate because both flows drive vLLM only through these, and
they know nothing of checkpoints.
"""
