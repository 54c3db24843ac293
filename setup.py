from setuptools import find_packages, setup

setup(
    name="accessory",
    version="0.1.0",
    description="Tensor-parallel inference runtime for LLaMA-family models, compatible with LLaMA2-Accessory",
    packages=find_packages(include=["accessory", "accessory.*"]),
    # compiled on the user's machine at first use (accessory/kernels/build.py)
    package_data={"accessory.kernels": ["cpu_kernels.c", "torch_ops.cpp"]},
    python_requires=">=3.10",
    # torch is pinned in requirements.txt (installed in the same pip command); any recent torch works here.
    install_requires=["torch>=2.4", "numpy", "sentencepiece", "tokenizers", "safetensors", "jinja2", "tqdm",
                      "gguf", "transformers", "pyyaml"],
    extras_require={"test": ["pytest", "accelerate"]},
    entry_points={"console_scripts": ["accessory=accessory.cli:main"]},
)
