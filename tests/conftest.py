import os

# Multi-process tests share two cores: one thread per process avoids oversubscription.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Triton (where installed) runs its kernels on this CPU only under its interpreter, and it decides
# when it is first imported (which torch may do before tests/test_kernels.py does) whether its
# language functions are interpreted: so for the whole session. Nothing else runs Triton on a CPU
# (`training.kernels=auto` picks the PyTorch references there).
os.environ.setdefault("TRITON_INTERPRET", "1")
