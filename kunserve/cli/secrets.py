"""`python -m kunserve.cli.secrets DIR`: write a new cluster secret and admin token for compose.yaml.

Compose (without swarm) bind-mounts a Secret's file with its host permissions, and the services run as
uid 10001 in the container, so the files are 0644 inside a 0700 directory: only the owner can reach them
on the host. Existing files are kept (the cluster's credentials do not change under it).
"""

from __future__ import annotations

import argparse
import os
import pathlib

from kunserve.shared.credentials import ADMIN_TOKEN, CLUSTER_SECRET, write_token


def write_compose_secrets(directory: pathlib.Path) -> list[pathlib.Path]:
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    out = []
    for kind in (CLUSTER_SECRET, ADMIN_TOKEN):
        path = directory / kind.default_file
        if not path.exists():
            write_token(path)
        os.chmod(path, 0o644)
        out.append(path)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kunserve.cli.secrets", description=__doc__.splitlines()[0])
    ap.add_argument("directory", nargs="?", default="docker/secrets", help="where (default: docker/secrets)")
    args = ap.parse_args(argv)
    for path in write_compose_secrets(pathlib.Path(args.directory)):
        print(path)


if __name__ == "__main__":
    main()
