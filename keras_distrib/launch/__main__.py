"""`python -m keras_distrib.launch launch -n 2 train.py`: the same as `keras-distrib`."""

from keras_distrib.launch.cli import run

if __name__ == "__main__":
    run()
