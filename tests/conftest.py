import os

# Multi-process tests share two cores: one thread per process avoids oversubscription.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Triton (where installed) runs its kernels on this CPU only under its interpreter, and it decides
# when it is first imported (which torch may do before tests/test_kernels.py does) whether its
# language functions are interpreted: so for the whole session. Nothing else runs Triton on a CPU
# (`training.kernels=auto` picks the PyTorch references there).
os.environ.setdefault("TRITON_INTERPRET", "1")

# Property tests draw the same examples on every run and every machine (a failure found once is
# found again, and CI cannot pass by luck), and keep no example database in the checkout.
from hypothesis import settings  # noqa: E402

settings.register_profile("seeded", derandomize=True, database=None)
settings.load_profile("seeded")
