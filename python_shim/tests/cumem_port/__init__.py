"""vLLM's sleep-mode allocator tests, ported (test_cumem_port.py runs them)."""
