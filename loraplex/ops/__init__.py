"""The kernels: the LoRA delta over a step's slot groups (``lora.py`` torch ops, ``lora_sgmv.py`` one C++
call per layer, ``lora_triton.py`` on CUDA; ``lora_batch.py`` its input), the base matmuls (``dense.py``
packed float32, ``int8.py`` weight-only int8), and the decode step's non-matmul work (``cpu_kernels.py``:
paged attention, norms, rotary, fused glue), each C++ source built for AVX2 and AVX-512 by
``cpp_build.py`` and chosen at run time."""
