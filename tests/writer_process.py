"""A writer run as a separate process by the concurrency and crash tests.

    python tests/writer_process.py DB ACK_FILE TAG COMMITS

Each commit is a transaction writing K nodes (each with a parent edge, a
reward and an artifact) where K cycles 1..3. After a commit is acknowledged the
writer appends ``<commit id> <node ids...>`` to ACK_FILE and fsyncs it, so the
test knows which commits the database promised to keep.

With ``TRELLIS_TEST_DIE_IN_CHECKPOINT=<table>`` the process SIGKILLs itself inside its first
checkpoint that comes after ``TRELLIS_TEST_DIE_AFTER`` commits (default 30), right after that
checkpoint's Lance append to ``<table>``: the tables after it never get the WAL's rows.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    import trellisdb

    path, ack_path, tag, n_commits = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    db = trellisdb.connect(path, embedding_dim=4, compact_fragments=8)
    die_in = os.environ.get("TRELLIS_TEST_DIE_IN_CHECKPOINT")
    armed = [False]
    if die_in:
        import signal

        from trellisdb.storage.tables import LanceTables

        real = LanceTables.append

        def append(self: LanceTables, name: str, data: object) -> None:
            real(self, name, data)  # type: ignore[arg-type]
            if armed[0] and name == die_in:
                os.kill(os.getpid(), signal.SIGKILL)

        LanceTables.append = append  # type: ignore[method-assign]
    die_after = int(os.environ.get("TRELLIS_TEST_DIE_AFTER", "30"))
    # checkpoint the WAL often, so that kills land inside checkpoints too
    db._committer.checkpoint_commits = int(os.environ.get("TRELLIS_TEST_CHECKPOINT_COMMITS", "25"))
    with db.transaction():
        s = db.session(task="crash-task", agent=f"writer-{tag}")
    print("ready", flush=True)
    prev: str | None = None
    ack = os.open(ack_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for i in range(n_commits):
        k = 1 + i % 3
        ids = []
        with db.transaction(message=f"{tag} {i} k={k}") as tx:
            for j in range(k):
                nid = s.add_node(
                    id=f"{tag}-{i}-{j}",
                    parents=[prev] if prev else [],
                    summary=f"step {i}.{j}",
                    artifacts={"code": f"# {tag} {i} {j}\n" * 50},
                    embedding=[float(i), float(j), 1.0, 0.5],
                )
                s.add_reward(nid, "score", i + j / 10)
                ids.append(nid)
        cid = tx.commit_id
        os.write(ack, f"{cid} {' '.join(ids)}\n".encode())
        os.fsync(ack)
        prev = ids[-1]
        armed[0] = bool(die_in) and i + 1 >= die_after
    db.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
