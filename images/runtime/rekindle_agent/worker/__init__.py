"""Code that runs inside vLLM's worker processes, never in the agent.

vllm_extension.py is the --worker-extension-cls that vLLM loads by name
(rekindle_contract.rpc.WORKER_EXTENSION) in each worker: it dumps, releases
and reloads the weights. It is the only code of the agent's package that
imports torch, vLLM or rekindle_weights, and nothing of the agent imports it
(import-linter checks both): the agent talks to it only through vLLM's
collective RPC. This file stays empty of imports so that loading the
extension pulls in nothing more than it needs.
"""
