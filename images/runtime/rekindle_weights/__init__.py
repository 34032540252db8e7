"""Weight dump and fast parallel reload, usable with or without vLLM."""
