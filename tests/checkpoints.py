"""Test helper: a TensorFlow 1 checkpoint written the way OpenAI's GPT-2 files are (a Saver's
``model.ckpt.*`` beside ``hparams.json``), from arrays the test chose."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest


def write_tf_checkpoint(folder: Path, arrays: dict[str, np.ndarray], hparams: dict[str, int]) -> Path:
    """Write ``arrays`` as TF variables of those names into ``folder`` (skips without TensorFlow)."""
    tf = pytest.importorskip("tensorflow")
    graph = tf.Graph()
    with graph.as_default():
        for name, value in arrays.items():
            tf.compat.v1.Variable(value, name=name)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.save(sess, str(folder / "model.ckpt"))
    (folder / "hparams.json").write_text(json.dumps(hparams))
    return folder
