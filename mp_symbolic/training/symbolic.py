"""The symbolic variant: the Pipeline's tagged graph, bound with ``group2ctx``.

Two ways to drive the same graph, behind one small "stepper" interface
(``step(X, y)`` runs forward, backward and one update and returns the batch
loss as an NDArray, left unread so steps are not synchronised):

* :class:`ModuleStepper`: MXNet's ``Module`` (a :class:`~mp_symbolic.core.engine.module.PipelineModule`,
  ``group2ctxs``, replicas and kvstores included);
* :class:`ExecutorStepper`: the runtime of the Pipeline's schedule
  (:func:`~mp_symbolic.core.engine.runtime.bind`: GPipe's one graph bound with
  ``Symbol.simple_bind(group2ctx=...)``, or the stage runtime) and an
  optimizer updater in a plain loop.

References: MXNet 1.9.1 ``tests/python/unittest/test_model_parallel.py``
(executor + ``group2ctx``), ``test_module.py::test_module_ctx_group``
(Module + ``group2ctxs``).
"""
from collections import OrderedDict
from collections.abc import Mapping

import mxnet as mx
import numpy as np

from .data import padded_batches, staged_batches, steps_per_epoch
from ..core.optim.updater import PerDeviceUpdater
from ..core.optim.optstate import drop_states, set_states_by_name, states_by_name
from ..core.task import as_inputs
from ..core.transport.comm import control
from ..core.base.compat import write_into
from ..core.parallel.tensor_parallel import gather_made
from ..core.engine import runtime

__all__ = []


def create_optimizer(cfg, rescale_grad=None, task=None):
    """``cfg``'s optimizer; gradients averaged over the global batch by default.
    With ``task`` given, its learning rate follows the task's ``lr_schedule``
    over the run's ``num_epochs`` epochs of ``batch_size`` batches."""
    rescale = 1.0 / cfg.batch_size if rescale_grad is None else rescale_grad
    params = cfg.optimizer_params()
    if task is not None and task.lr_schedule is not None:
        steps = cfg.num_epochs * steps_per_epoch(len(task.data().y), cfg.batch_size)
        params['lr_scheduler'] = task.lr_schedule(cfg.lr, steps)
    return mx.optimizer.create(cfg.optimizer, rescale_grad=rescale, **params)


def _float32(values):
    """``values`` (name -> numpy array) with each array of another dtype as
    float32, as ``mx.nd.array`` would make it; float32 arrays as they are."""
    return OrderedDict((k, v if isinstance(v, np.ndarray) and v.dtype == np.float32
                        else np.asarray(v, dtype=np.float32)) for k, v in values.items())


class _SymbolicStepper:
    """What both symbolic steppers share: the bound arrays of each replica
    (:meth:`_replicas`) and the runtime that runs them (:meth:`_runtime`)."""

    def __init__(self, pipe, task, cfg):
        self.pipe, self.plan, self.task, self.cfg = pipe, pipe.plan, task, cfg
        self.label_name = task.label
        self.data_names = pipe.data_names()  # ('data',), or data0, data1, ... for several
        self.shard = (0, 1)

    def batches(self, X, y, epoch):
        return staged_batches(X, y, self.cfg.batch_size, epoch, self.cfg.seed,
                              self.plan.first_device, self.plan.last_device, self.shard)

    def _replicas(self):
        """``[(arg_dict, grad_dict, aux_dict)]``: each replica's bound arrays by name."""
        raise NotImplementedError

    def _runtime(self):
        """The first replica's :class:`~mp_symbolic.core.engine.runtime.Runtime`."""
        raise NotImplementedError

    @property
    def _arrays(self):
        return self._replicas()[0]

    @property
    def param_names(self):
        inputs = set(self._inputs())
        return [n for n in self._arrays[0] if n not in inputs]

    def param_shapes(self):
        """``{name: shape}`` of the parameters this process holds."""
        return {n: self._arrays[0][n].shape for n in self.param_names}

    def held_names(self):
        """The names of the parameters and auxiliary states this process
        holds (over nodes, its stages')."""
        return list(self.param_names) + list(self._arrays[2])

    def _inputs(self):
        """The executors' arguments that are not parameters."""
        return list(self.data_names) + [self.label_name]

    def params(self, lazy=False):
        """Every parameter by name (numpy); with ``lazy`` a :class:`HostArrays`
        (each read when asked for, as it is then)."""
        arrays = OrderedDict((n, self._arrays[0][n]) for n in self.param_names)
        return HostArrays(arrays) if lazy else \
            OrderedDict((n, a.asnumpy()) for n, a in arrays.items())

    def aux(self, lazy=False):
        """Every auxiliary state by name (numpy), as :meth:`params`."""
        arrays = OrderedDict(self._arrays[2])
        return HostArrays(arrays) if lazy else \
            OrderedDict((n, a.asnumpy()) for n, a in arrays.items())

    def grads(self):
        grad_dict = self._arrays[1]
        return OrderedDict((n, grad_dict[n].asnumpy()) for n in self.param_names
                           if grad_dict.get(n) is not None)

    def placement(self):
        """``[(name, array device, gradient device or None)]`` as MXNet reports them,
        auxiliary states (BatchNorm statistics) included."""
        rows = []
        replicas = self._replicas()
        for r, (arg_dict, grad_dict, aux_dict) in enumerate(replicas):
            tag = '' if len(replicas) == 1 else ' [replica %d]' % r
            rows += [(n + tag, a.context, grad_dict[n].context
                      if grad_dict.get(n) is not None else None)
                     for n, a in arg_dict.items()]
            rows += [(n + tag, a.context, None) for n, a in aux_dict.items()]
        return rows

    def cross_device_copies(self):
        """``(forward, backward)`` copies between devices per step: the
        ``_CrossDeviceCopy`` nodes MXNet inserted when it bound the graph
        with ``group2ctx`` (read from ``debug_str()``), and on the stage
        runtime the boundary tensors its transport carries
        (:meth:`~mp_symbolic.core.engine.runtime.Runtime.device_copies`)."""
        return self._runtime().device_copies()


class HostArrays(Mapping):
    """One process's arrays by name (numpy), each copied to the host when
    asked for and not kept: a reader that takes one at a time holds one
    host copy at a time, not the model's. A value is the array's as it is
    when read.

    Args:
        arrays: name -> NDArray.
    """

    def __init__(self, arrays):
        self._arrays = arrays

    def __getitem__(self, name):
        return self._arrays[name].asnumpy()

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self):
        return len(self._arrays)

    def __contains__(self, name):
        return name in self._arrays


class NodeArrays(Mapping):
    """Every node's arrays by name, one mapping on every node that holds
    none of another node's: a value is read when asked for, from the node
    that holds it, as one array (:meth:`~mp_symbolic.core.transport.comm.ControlPlane.broadcast_array`),
    and not kept. A node so holds its own arrays and at most the one it reads.

    Reading a value is a step every node takes together: every node reads
    the same names in the same order (the report and the parameters'
    digest do: every node runs them alike), while the nodes are joined.
    The names, their shapes and dtypes are gathered once, when made;
    ``len``, ``in`` and iteration (the nodes' names in rank order) ask no node.

    Args:
        group: The nodes' :class:`~mp_symbolic.core.transport.comm.ControlPlane`.
        arrays: This node's arrays, name -> NDArray; a name several nodes
            hold (replicas alike) is read from the first.

    Raises:
        NodeFailure: (on reading) a node died or stopped answering.
    """

    def __init__(self, group, arrays):
        self._group, self._arrays = group, arrays
        self._where = OrderedDict()
        mine = [[n, np.dtype(a.dtype).name, list(a.shape)] for n, a in arrays.items()]
        for rank, part in enumerate(group.gather(mine)):
            for name, dtype, shape in part:
                self._where.setdefault(name, (rank, dtype, tuple(shape)))

    def __getitem__(self, name):
        rank, dtype, shape = self._where[name]
        value = self._arrays[name].asnumpy() if rank == self._group.rank else None
        return self._group.broadcast_array(value, rank, shape, dtype)

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)

    def __contains__(self, name):
        return name in self._where

    def node_of(self, name):
        """The node ``name`` is read from."""
        return self._where[name][0]


class ModuleStepper(_SymbolicStepper):
    """The Pipeline trained through its ``PipelineModule`` (``mx.mod.Module``).

    Args:
        pipe: The :class:`~mp_symbolic.Pipeline`.
        task: The task module (loss, label name, batch loss).
        cfg: The :class:`~mp_symbolic.training.config.TrainConfig`.
        init: ``(arg_params, aux_params)`` as numpy dicts.
        label_shape: Shape of one example's label.
        kvstore: A kvstore instance or name (``cfg.kvstore`` by default);
            with ``dist_sync`` each worker trains its shard of every batch.
    """

    def __init__(self, pipe, task, cfg, init, label_shape, kvstore=None):
        super().__init__(pipe, task, cfg)
        kvstore = cfg.kvstore if kvstore is None else kvstore
        if isinstance(kvstore, str) and kvstore.startswith('dist'):
            kvstore = mx.kv.create(kvstore)
        if isinstance(kvstore, mx.kvstore.KVStore) and 'dist' in kvstore.type:
            self.shard = (kvstore.rank, kvstore.num_workers)
            if cfg.batch_size % (kvstore.num_workers * pipe.chunks * pipe.replicas):
                raise ValueError('batch_size: expected a multiple of workers x chunks x '
                                 'replicas (%d x %d x %d), found %d'
                                 % (kvstore.num_workers, pipe.chunks, pipe.replicas,
                                    cfg.batch_size))
        self.kvstore = kvstore
        local = cfg.batch_size // self.shard[1]
        self.module = pipe.module(loss=task.graph_loss, label_name=self.label_name)
        self.module.bind(data_shapes=task.data_shapes(local, self.data_names),
                         label_shapes=[(self.label_name, (local,) + tuple(label_shape))])
        arg_params, aux_params = init
        # numpy values are written into the devices' arrays one by one: no
        # NDArray copy of the whole model is made on the way
        self.module.init_params(arg_params=_float32(arg_params), aux_params=_float32(aux_params),
                                allow_missing=False)
        self.module.init_optimizer(kvstore=kvstore, optimizer=create_optimizer(cfg, task=task))
        self._local = local
        nodes = pipe.nodes
        self._group = control(nodes, 'share the losses', self.plan.node_of_stage)
        self._holds_head = nodes is None or nodes.rank == self.plan.node_of_stage[-1]

    def _inputs(self):
        # over nodes, also the tensors this node receives from another
        return list(self.module.data_names) + list(self.module.label_names) + \
            [self.label_name]

    def _replicas(self):
        """Each replica's bound arrays by name, in the graph's argument
        order, its inputs as its runtime's executors bind them."""
        found = []
        for arrays, bound in zip(self.module.executors, self.module.runtimes):
            inputs = {n: a for exe in bound.executors for n, a in exe.arg_dict.items()}
            arg_dict = OrderedDict(
                (n, arrays.arg_dict[n] if n in arrays.arg_dict else inputs[n])
                for n in self.module.symbol.list_arguments()
                if n in arrays.arg_dict or n in inputs)
            found.append((arg_dict, arrays.grad_dict, arrays.aux_dict))
        return found

    def _runtime(self):
        return self.module.runtimes[0]

    def step(self, X, y):
        """One step on the batch ``(X, y)``, or with ``y`` ``None`` on the
        DataBatch ``X`` as it is (a bucketed DataIter's: its ``bucket_key``
        and ``provide_data`` choose the bound form)."""
        if y is None:
            batch, y = X, X.label[0]
        else:
            batch = mx.io.DataBatch(data=list(as_inputs(X)), label=[y])
        self.module.forward(batch, is_train=True)
        self.module.backward()
        self.module.update()
        if not self._holds_head:
            return None  # the loss is the last node's (read_losses shares it)
        # the head's output, each replica's part of the batch
        outputs = self.module.get_outputs(merge_multi_context=False)[0]
        part = len(y) // len(outputs)
        losses = [self.task.batch_loss(o, y[r * part:(r + 1) * part].as_in_context(o.context))
                  .as_in_context(outputs[0].context) for r, o in enumerate(outputs)]
        return losses[0] if len(losses) == 1 else mx.nd.add_n(*losses) / len(losses)

    def predict(self, X):
        outputs = []
        for batch, count in padded_batches(X, self._local):  # the bound batch size
            self.module.forward(mx.io.DataBatch(data=[mx.nd.array(b) for b in batch]),
                                is_train=False)
            if self._holds_head:
                outputs.append(self.module.get_outputs()[0].asnumpy()[:count])
        return self._shared(np.concatenate(outputs) if outputs else None)

    def predict_batch(self, batch):
        """The network's outputs (numpy) for the DataBatch ``batch``, at its
        bucket's shapes (over nodes, on every node)."""
        self.module.forward(batch, is_train=False)
        return self._shared(self.module.get_outputs()[0].asnumpy() if self._holds_head
                            else None)

    # -- over nodes: what the node of the loss head holds, shared -----------

    def _shared(self, value):
        """``value`` of the node holding the loss head, on every node."""
        return self._group.broadcast(value, self.plan.node_of_stage[-1])

    def read_losses(self, losses):
        """The batch losses' values (over nodes, the last node's, on every node)."""
        return self._shared(mx.nd.stack(*losses).asnumpy().ravel() if self._holds_head
                            else None)

    def _everyone(self, arrays, lazy):
        """Every node's ``arrays`` (name -> NDArray) as numpy: copied now, or
        with ``lazy`` each read when asked for (a :class:`HostArrays`); over
        nodes always a :class:`NodeArrays` (read from its node when asked for)."""
        if self.pipe.nodes is None:
            return HostArrays(OrderedDict(arrays)) if lazy else \
                OrderedDict((n, a.asnumpy()) for n, a in arrays.items())
        return NodeArrays(control(self.pipe.nodes, 'read the parameters', self.plan.node_of_stage),
                          arrays)

    def params(self, lazy=False):
        """Every parameter by name (numpy); with ``lazy`` a :class:`HostArrays`
        (each read when asked for, as it is then); over nodes a :class:`NodeArrays`."""
        return self._everyone(OrderedDict((n, self._arrays[0][n]) for n in self.param_names),
                              lazy)

    def aux(self, lazy=False):
        """Every auxiliary state by name (numpy), as :meth:`params`."""
        return self._everyone(self._arrays[2], lazy)

    def arg_aux(self):
        """``(arg_params, aux_params)`` as NDArrays on ``cpu()``, to be read
        before the next step: with one replica, an array the Module holds on
        ``cpu()`` is handed out itself, not copied (the values ``get_params``
        would copy, bit for bit)."""
        module = self.module
        if len(module._context) > 1 or module.host_copy or \
                any(a[0].stype != 'default' for a in module._exec_group.param_arrays):
            return module.get_params()  # the replicas averaged, as MXNet averages them
        group, host = module._exec_group, mx.cpu()

        def held(arrays):
            return arrays[0] if arrays[0].context == host else arrays[0].copyto(host)
        arg = OrderedDict((n, held(a)) for n, a in zip(module._param_names, group.param_arrays))
        aux = OrderedDict((n, held(a)) for n, a in zip(module._aux_names, group.aux_arrays))
        return self.pipe.gather_params(arg), aux

    def set_params(self, arg_params, aux_params, allow_missing=False):
        """Sets every replica's parameters (numpy values), each on its device;
        with ``allow_missing``, those given only (the others keep theirs)."""
        # Module.set_params' own path (init_params without an initializer),
        # which writes numpy values where the given ones only are allowed
        self.module.init_params(initializer=None, arg_params=_float32(arg_params),
                                aux_params=_float32(aux_params), allow_missing=allow_missing,
                                force_init=True)

    def optimizer_states(self, lazy=False):
        return self.module.optimizer_states(lazy=lazy)

    def lazy_params(self):
        """:meth:`arg_aux`'s names, each value a function making that one
        array on the host (:meth:`~mp_symbolic.core.engine.module.PipelineModule.lazy_params`)."""
        return self.module.lazy_params()

    def set_optimizer_states(self, states):
        self.module.set_optimizer_states(states)


class ExecutorStepper(_SymbolicStepper):
    """The Pipeline's graph bound as the runtime its schedule runs on
    (:func:`~mp_symbolic.core.engine.runtime.bind`: GPipe's one graph, or the
    stage runtime), updated by an optimizer updater in a plain loop (one
    replica)."""

    def __init__(self, pipe, task, cfg, init, label_shape):
        super().__init__(pipe, task, cfg)
        shapes = dict(task.data_shapes(cfg.batch_size, self.data_names),
                      **{self.label_name: (cfg.batch_size,) + tuple(label_shape)})
        plain = []
        self.runtime = runtime.bind(pipe, task.graph_loss, self.label_name, shapes, plain)
        arg_dict, grad_dict, aux_dict = self.runtime.parameters
        arg_params, aux_params = init
        for name, value in arg_params.items():
            arg_dict[name][:] = value
        for name, value in aux_params.items():
            aux_dict[name][:] = value
        self._batch = cfg.batch_size
        self._optimizer = create_optimizer(cfg, task=task)
        self._updater = PerDeviceUpdater(mx.optimizer.get_updater(self._optimizer))
        self._updater.plain(plain)
        self._names = self.param_names
        # constants and frozen layers (grad_req 'null') get no gradient and no update
        self._fixed = {n for n in self._names if grad_dict.get(n) is None}
        trained = [i for i, n in enumerate(self._names) if n not in self._fixed]
        self._update_args = (trained, [grad_dict[self._names[i]] for i in trained],
                             [arg_dict[self._names[i]] for i in trained])
        self._label = None

    def _replicas(self):
        return [self.runtime.parameters]

    def _runtime(self):
        return self.runtime

    def _loss(self):
        out = self.runtime.outputs[0]
        return self.task.batch_loss(out, self._label.as_in_context(out.context))

    def update_step(self, X, y):
        """Forward, backward and one update on a staged batch; no loss is read."""
        inputs = dict(zip(self.data_names, as_inputs(X)))
        inputs[self.label_name] = self._label = y
        self.runtime.run(inputs, train=True)
        # weight, gradient and optimizer state of each parameter share its device
        self._updater(*self._update_args)

    def step(self, X, y):
        self.update_step(X, y)
        return self._loss()

    def predict(self, X):
        """Inference-mode outputs over ``X``, in batches of the bound size."""
        outputs = []
        for batch, count in padded_batches(X, self._batch):
            self.runtime.run({n: mx.nd.array(part) for n, part in zip(self.data_names, batch)},
                             train=False)
            outputs.append(self.runtime.outputs[0].asnumpy()[:count])
        return np.concatenate(outputs)

    def set_params(self, arg_params, aux_params, allow_missing=False):  # pylint: disable=unused-argument
        """Sets the parameters given (numpy values), also into an array
        oneDNN keeps in its own layout after a step; the others keep their
        values (with ``allow_missing`` or without)."""
        arg_dict, _, aux_dict = self.runtime.parameters
        for name, value in arg_params.items():
            write_into(arg_dict[name], value)
        for name, value in aux_params.items():
            write_into(aux_dict[name], value)

    def arg_aux(self):
        arg_dict, _, aux_dict = self.runtime.parameters
        return ({n: arg_dict[n].copyto(mx.cpu()) for n in self._names},
                {n: a.copyto(mx.cpu()) for n, a in aux_dict.items()})

    def lazy_params(self):
        """:meth:`arg_aux`'s names (a tensor-parallel layer's shards joined
        under its unsplit name), each value a function of no arguments
        making that one array on the host (numpy, the same bits) when
        called: a writer taking them one at a time holds one at a time."""
        arg_dict, _, aux_dict = self.runtime.parameters
        if aux_dict:  # the running statistics' last update done before they are read
            mx.nd.waitall()
        made = OrderedDict((n, arg_dict[n].asnumpy) for n in self._names)
        return (gather_made(made, self.pipe.sharded),
                OrderedDict((n, a.asnumpy) for n, a in aux_dict.items()))

    def optimizer_states(self, lazy=False):
        """The optimizer state by parameter name (:func:`~mp_symbolic.core.optim.optstate.states_by_name`;
        with ``lazy`` each of its arrays a function making it on the host when called)."""
        return states_by_name(self._updater, self._optimizer, OrderedDict(enumerate(self._names)),
                              lazy=lazy)

    def set_optimizer_states(self, states):
        arg_dict = self.runtime.parameters[0]
        targets = {n: (i, arg_dict[n].context) for i, n in enumerate(self._names)}
        set_states_by_name(self._updater, self._optimizer, drop_states(states, self._fixed),
                           targets)
