"""torch_memory_saver's own tests (``test/examples/``), ported to run over testdrv under both the
original (the torch_memory_saver 0.0.10 wheel) and stepalloc's saver; see ``test_tms_port.py``."""
