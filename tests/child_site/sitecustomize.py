"""Run at start-up by every Python process the tests start: tests/conftest.py
(fixture `child_site`) puts this directory on their PYTHONPATH.

Keras imports pandas and matplotlib when it is imported, if they are
installed (keras/src/trainers/data_adapters/array_slicing.py and
keras/src/visualization/plot_image_gallery.py): about 0.7 CPU-s, paid by
each of the processes a test run starts. The test environment has them for
Ray Train (pandas) and the benchmark figures (matplotlib); no process a
test starts uses them. A module set to None in `sys.modules` is one Python
treats as missing, so `import pandas` raises ImportError, which Keras
expects.

Importing TensorFlow and Keras leaves some 400,000 objects behind, which
Python's collector would walk at each of its full collections
(tests/child_site/frozen_imports.py): here it is set to freeze them.

The Ray test takes this directory off its cluster's path (Ray Train imports
pandas).
"""

import sys

import frozen_imports

for _name in ("pandas", "matplotlib"):
    sys.modules.setdefault(_name, None)

frozen_imports.install()
