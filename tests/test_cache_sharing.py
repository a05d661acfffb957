"""Two checkouts (or processes) sharing ~/.cache/paged: the default model is
fetched by one while the others wait, and never seen half-written."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time

FETCH = "from paged.core.models.files import default_model_path; print(default_model_path(quiet=True))"


def test_a_waiting_process_takes_the_file_the_lock_holder_wrote(tmp_path, default_model_path):
    models = tmp_path / "models"
    models.mkdir()
    # any download attempt by the child fails at once: the only way it can
    # succeed is by finding the file we put in place while it waited
    env = {**os.environ, "PAGED_CACHE_DIR": str(tmp_path), "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
           "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "", "PIP_NO_INDEX": "1"}
    with open(models / ".fetch.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        child = subprocess.Popen([sys.executable, "-c", FETCH], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)  # not a timing assert: the child must simply not have finished yet
        assert child.poll() is None, child.communicate()
        partial = models / "incoming.part"
        shutil.copyfile(default_model_path, partial)
        os.replace(partial, models / default_model_path.name)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert out.strip() == str(models / default_model_path.name)
