import os

# Transformers imports torch_xla whenever it is installed; tests that want XLA run it in their own
# processes, so the test process itself stays plain PyTorch.
os.environ.setdefault("USE_TORCH_XLA", "0")
