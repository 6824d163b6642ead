import os
import sys

# Multi-process tests share two cores: one thread per process avoids oversubscription.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))
