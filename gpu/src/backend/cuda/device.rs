//! Thin, owned wrappers over cudarc: the context with its one stream and
//! cuBLAS handle, device buffers addressed by raw pointer (kernels take
//! pointers into shared buffers, which borrow-checked views cannot express),
//! and the one GEMM shape every projection uses.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{CudaBlas, result as blas, sys as blas_sys};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits, sys};

use super::compile::cuda_err;
use crate::backend::BackendError;

/// A device allocation and its address.
pub struct Buf<T> {
    slice: Option<CudaSlice<T>>,
    /// Device address of element 0 (0 while empty).
    pub ptr: u64,
    /// Elements allocated.
    pub len: usize,
}

impl<T> Default for Buf<T> {
    fn default() -> Self {
        Buf { slice: None, ptr: 0, len: 0 }
    }
}

impl<T: DeviceRepr + ValidAsZeroBits> Buf<T> {
    /// A zeroed buffer of `len` elements.
    pub fn zeros(gpu: &Gpu, len: usize) -> Result<Buf<T>, BackendError> {
        let mut b = Buf::default();
        b.ensure(gpu, len)?;
        Ok(b)
    }

    /// A copy of `host` on the device.
    pub fn from_host(gpu: &Gpu, host: &[T]) -> Result<Buf<T>, BackendError> {
        let slice = gpu.stream.clone_htod(host).map_err(|e| cuda_err("copying weights to the device", e))?;
        Ok(Buf::wrap(gpu, slice))
    }

    fn wrap(gpu: &Gpu, slice: CudaSlice<T>) -> Buf<T> {
        let ptr = slice.device_ptr(&gpu.stream).0;
        Buf { len: slice.len(), slice: Some(slice), ptr }
    }

    /// Grows the buffer to at least `len` elements, by half again at least
    /// so that slowly growing steps do not reallocate every time (contents
    /// are lost when it grows; a failed growth leaves it empty).
    pub fn ensure(&mut self, gpu: &Gpu, len: usize) -> Result<(), BackendError> {
        if self.len >= len && self.slice.is_some() {
            return Ok(());
        }
        let len = len.max(self.len + self.len / 2).max(1);
        *self = Buf { slice: None, ptr: 0, len: 0 };
        let slice = gpu
            .stream
            .alloc_zeros::<T>(len)
            .map_err(|e| cuda_err(&format!("allocating {} bytes", len * size_of::<T>()), e))?;
        *self = Buf::wrap(gpu, slice);
        Ok(())
    }

    /// Copies `host` to the start of the buffer, growing it first if needed.
    pub fn upload(&mut self, gpu: &Gpu, host: &[T]) -> Result<(), BackendError> {
        self.ensure(gpu, host.len())?;
        let s =
            self.slice.as_mut().ok_or_else(|| BackendError::InvalidStep("upload to an unallocated buffer".into()))?;
        let mut view = s.slice_mut(..host.len());
        gpu.stream.memcpy_htod(host, &mut view).map_err(|e| cuda_err("copying a step to the device", e))
    }

    /// Copies the first `out.len()` elements to `out` (waits for the stream).
    pub fn download(&self, gpu: &Gpu, out: &mut [T]) -> Result<(), BackendError> {
        let s = self
            .slice
            .as_ref()
            .ok_or_else(|| BackendError::InvalidStep("download from an unallocated buffer".into()))?;
        if out.len() > self.len {
            return Err(BackendError::InvalidStep(format!("download of {} elements from {}", out.len(), self.len)));
        }
        let view = s.slice(..out.len());
        gpu.stream.memcpy_dtoh(&view, out).map_err(|e| cuda_err("copying results to the host", e))?;
        gpu.stream.synchronize().map_err(|e| cuda_err("running a step", e))
    }

    /// Bytes allocated.
    pub fn bytes(&self) -> usize {
        self.len * size_of::<T>()
    }
}

/// The device, its stream and the cuBLAS handle bound to it.
pub struct Gpu {
    /// The context (primary context of the device).
    pub ctx: Arc<CudaContext>,
    /// The one stream every step runs on.
    pub stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// Element type of weights and activations as cuBLAS names it.
    pub dtype: blas_sys::cudaDataType,
}

impl Gpu {
    /// Opens device `ordinal`. The caller has checked that a device exists.
    pub fn open(ordinal: usize, f16: bool) -> Result<Gpu, BackendError> {
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err(&format!("opening device {ordinal}"), e))?;
        // One stream, ordered: cudarc's per-buffer event tracking is not needed.
        // SAFETY: called before any buffer exists; every use stays on `stream`.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| cuda_err("creating a stream", e))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| cuda_err("starting cuBLAS", e))?;
        let dtype = if f16 { blas_sys::cudaDataType::CUDA_R_16F } else { blas_sys::cudaDataType::CUDA_R_16BF };
        Ok(Gpu { ctx, stream, blas, dtype })
    }

    /// The device's name, compute capability and memory, for logs.
    pub fn describe(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "unknown device".into());
        let (major, minor) = self.ctx.compute_capability().unwrap_or((0, 0));
        let total = self.ctx.total_mem().unwrap_or(0) >> 20;
        format!("{name}, sm_{major}{minor}, {total} MiB")
    }

    /// Device memory free now, in bytes.
    pub fn free_memory(&self) -> Result<usize, BackendError> {
        self.ctx.mem_get_info().map(|(free, _)| free).map_err(|e| cuda_err("reading free device memory", e))
    }

    /// `y[n x out] = x[n x inp] . w[out x inp]^T + beta * y`, all row-major:
    /// `w` and `x` 16-bit, `y` f32, accumulated in f32.
    ///
    /// # Safety
    /// The pointers must address live buffers of at least those sizes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm(
        &self,
        w: u64,
        x: u64,
        y: u64,
        n: usize,
        out: usize,
        inp: usize,
        beta: f32,
    ) -> Result<(), BackendError> {
        let alpha = 1f32;
        // Column-major view: y^T (out x n) = w (stored inp x out, transposed) . x^T (inp x n).
        // SAFETY: the caller vouches for the pointers; alpha and beta outlive the call.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                out as i32,
                n as i32,
                inp as i32,
                (&alpha as *const f32).cast::<c_void>(),
                w as *const c_void,
                self.dtype,
                inp as i32,
                x as *const c_void,
                self.dtype,
                inp as i32,
                (&beta as *const f32).cast::<c_void>(),
                y as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                out as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| cuda_err("a cuBLAS matrix product", e))
    }

    /// A timing event.
    pub fn event(&self) -> Result<CudaEvent, BackendError> {
        self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| cuda_err("creating an event", e))
    }

    /// Device-to-device copy bandwidth in bytes/s (bytes read plus bytes
    /// written over the time), timed with events over a `bytes`-sized copy.
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64, BackendError> {
        let n = bytes / 4;
        let src = self.stream.alloc_zeros::<u32>(n).map_err(|e| cuda_err("allocating the copy buffer", e))?;
        let mut dst = self.stream.alloc_zeros::<u32>(n).map_err(|e| cuda_err("allocating the copy buffer", e))?;
        let (start, end) = (self.event()?, self.event()?);
        let copy = |dst: &mut CudaSlice<u32>| self.stream.memcpy_dtod(&src, dst).map_err(|e| cuda_err("copying", e));
        copy(&mut dst)?;
        let reps = 10;
        start.record(&self.stream).map_err(|e| cuda_err("recording an event", e))?;
        for _ in 0..reps {
            copy(&mut dst)?;
        }
        end.record(&self.stream).map_err(|e| cuda_err("recording an event", e))?;
        end.synchronize().map_err(|e| cuda_err("waiting for the copy", e))?;
        let ms = start.elapsed_ms(&end).map_err(|e| cuda_err("timing the copy", e))?;
        Ok((2 * n * 4 * reps) as f64 / (f64::from(ms) / 1e3))
    }
}
