"""The digits world's two classifiers, fitted at first use on the training part of the fixed split,
through the same render -> features road that generated images take (deterministic, < 2 s):
a multinomial logistic regression and 5-nearest-neighbours, both on 8x8 box-averaged grey levels."""
from . import data

_FITTED = {}


def _training_features():
    (x, y), _ = data.load_split()
    return data.features(data.render(x)), y


def logistic_classifier():
    if "logistic" not in _FITTED:
        from sklearn.linear_model import LogisticRegression
        x, y = _training_features()
        _FITTED["logistic"] = LogisticRegression(max_iter=2000, C=1.0).fit(x, y)
    return _FITTED["logistic"]


def neighbours_classifier():
    if "knn" not in _FITTED:
        from sklearn.neighbors import KNeighborsClassifier
        x, y = _training_features()
        _FITTED["knn"] = KNeighborsClassifier(n_neighbors=5).fit(x, y)
    return _FITTED["knn"]
