# The ModelForge image: one package, three roles (control worker, node worker, gateway).
FROM python:3.11.11-slim-bookworm
RUN useradd --create-home --uid 10001 modelforge
WORKDIR /app
COPY pyproject.toml README.md ./
COPY modelforge ./modelforge
COPY workflows ./workflows
COPY activities ./activities
COPY workers ./workers
RUN pip install --no-cache-dir .
USER modelforge
ENV MODELFORGE_HOME=/home/modelforge/.modelforge
ENTRYPOINT ["modelforge"]
