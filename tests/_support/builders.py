"""Small ForceMatching trainers on the pair-MLP problem
(problems.mlp_problem), for the error, service and checkpoint tests."""
from chemtrain.trainers import ForceMatching
from chemtrain.trainers.options import split_options
from problems import adam, mlp_problem


def build(tmp_path, **kw):
    data, params, template, nbrs = mlp_problem()
    kw.setdefault("batch", 4)
    kw.setdefault("parallelism", "single")
    kw.setdefault("progress", False)
    return ForceMatching(params, adam(), template, nbrs, checkpoint_path=str(tmp_path),
                         **split_options(kw, keep=("checkpoint_path", "log_file"))), data


def trainer(problem, folder, template=None, nbrs=None, **kw):
    data, params, tmpl, nb = problem
    return ForceMatching(params, adam(), tmpl if template is None else template,
                         nb if nbrs is None else nbrs, batch=4, parallelism="single",
                         checkpoint_path=str(folder),
                         **split_options(dict(kw, progress=False), keep=("checkpoint_path", "log_file")))
