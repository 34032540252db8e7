"""vLLM's process tree as Linux shows it: its processes, their exits, their /dev/shm files.

proctree.py (who is in the tree, what it maps and holds open, killing it from
/proc), reaper.py (reaping every child while the agent is PID 1) and
shm_files.py (the /dev/shm files the tree uses: found, saved, recreated,
removed). Separate because everything above (supervision, both flows, the
CRIU backend) needs this one view of the tree, and it needs nothing of theirs.
"""
