"""The agent's HTTP side: the admin API and the serve port's proxy in front of vLLM.

server.py (aiohttp handlers and the reverse proxy), relay.py (the one copy loop
of a request and its streamed answer, shared with the front, rekindle_front),
serve_routes.py (which paths the serve port forwards), vllm_queue.py (vLLM's
running and waiting requests read from its metrics, for GET /get_load and the
front) and auth.py (the admin token and the serve API key).
Separate because it sits above the Agent: it only reads the Agent's state and
hands blocking work to it, and nothing below may depend on aiohttp or on how
requests arrive (aiohttp costs about a second to import, after the restore has
started: cli.py imports server.py late on purpose).
"""
